"""The README's Python examples run as written (on a small generated checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path

from kda_tp.synth import write_small_checkpoint

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 2
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=96, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=16, num_layers=3, kda_layers=[0, 2])
    loader = blocks[0].replace("/models/Kimi-Linear-48B-A3B", str(ckpt))
    namespace: dict = {"rank": 1, "world_size": 2}
    exec(compile(loader, "README loader example", "exec"), namespace)
    assert namespace["weights"]["model.layers.0.self_attn.o_proj.weight"].shape == (96, 128)
    namespace = {}
    exec(compile(blocks[1], "README plan example", "exec"), namespace)
    assert namespace["local"].nbytes == namespace["o"].local_bytes
