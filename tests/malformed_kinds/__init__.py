"""The kinds of ``tests/malformed.py``, one module a kind of input: ``files`` (one safetensors
file's layout), ``index`` (``model.safetensors.index.json``), ``config`` (``config.json``),
``kda`` (the KDA tensors), ``cli`` (hostile command lines); ``core`` holds what they share (the
cases, the registries, the stdlib writers and the base checkpoint)."""
