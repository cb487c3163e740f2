"""The README's Python examples run as written (on a small generated checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path

from kda_tp.synth import write_small_checkpoint

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 2
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=96, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=16, num_layers=3, kda_layers=[0, 2])
    loader = blocks[0].replace("/models/Kimi-Linear-48B-A3B", str(ckpt))
    # The example defines everything it uses: rank and world size come from torchrun's
    # environment variables.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    namespace: dict = {}
    exec(compile(loader, "README loader example", "exec"), namespace)
    assert (namespace["rank"], namespace["world_size"]) == (1, 2)
    assert namespace["weights"]["model.layers.0.self_attn.o_proj.weight"].shape == (96, 128)
    namespace = {}
    exec(compile(blocks[1], "README plan example", "exec"), namespace)
    o = namespace["o"]
    assert len(namespace["raw"]) == o.full_bytes == 4096 * 8192 * 2  # a size in bytes
    assert namespace["local"].nbytes == o.local_bytes == o.full_bytes // 2
