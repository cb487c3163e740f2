"""The end of a weight-transfer session that bypassed ``load_weights``, engine-free
(``kda_tp.guard._transfer``): a rank's K3 parameters as vLLM's loaders leave them (built with
the build API, as test_updates.py builds them), judged with no fed values and by the trainer's
digests. Through vLLM's own engines: test_vllm_transfer.py."""

from __future__ import annotations

import numpy as np
import pytest

import kda_tp
from kda_tp import describe
from kda_tp.errors import UsageError
from kda_tp.guard import RankTarget
from kda_tp.guard._transfer import check_transfer, checked_digests

from test_updates import held
from tp_fixtures import CKPT, PRE

LAYOUT = "vllm-0.33-k3"
IN_PROJ = f"{PRE}in_proj_qkvgfab.weight"


def target_of(params: dict[str, np.ndarray]) -> RankTarget:
    return RankTarget.build(describe(CKPT["k3"]), params, tp_rank=1, tp_size=4)


def trainer_digests(tp_size: int = 4) -> dict[str, str]:
    return kda_tp.audit.engine_digests(CKPT["k3"], engine=LAYOUT, tp_size=tp_size,
                                       model_dtype="F32")  # the fixture's, as held


def test_right_parameters_pass_by_digests_and_by_invariants():
    params = held(CKPT["k3"], LAYOUT, 1, 4)
    report = check_transfer(target_of(params), None, trainer_digests())
    assert report.passed and report.digests == report.params == len(params) == 7
    assert report.how.startswith("checked by digests (7 parameters)")
    report = check_transfer(target_of(params), None, None)
    assert report.passed and report.digests is None
    assert report.how.startswith("invariants only (")


def test_a_negative_zero_in_the_padding_is_named_with_its_row_and_column():
    params = held(CKPT["k3"], LAYOUT, 1, 4)
    rows = params[IN_PROJ].shape[0]  # 1680: 1667 rows of parts, then 13 of padding
    params[IN_PROJ][rows - 2, 5] = -0.0
    report = check_transfer(target_of(params), None, None)
    assert report.problems == [
        f"{IN_PROJ}: padding: 1 of {13 * params[IN_PROJ].shape[1]} elements are not zero "
        f"(first at [{rows - 2}, 5]: -0.0, expected 0): the transport left the padding rows "
        "as it allocated them (the engine's loader zeroes them; a replay without the loader "
        "does not)"]
    report = check_transfer(target_of(params), None, trainer_digests())
    assert len(report.problems) == 2 and report.problems[1].startswith(
        f"{IN_PROJ}: SHA-256 ")  # the digest sees the same bit


def test_digests_of_another_world_size_are_not_a_check():
    params = held(CKPT["k3"], LAYOUT, 1, 4)
    report = check_transfer(target_of(params), None, trainer_digests(tp_size=1))
    assert not report.passed and report.problems == [] and len(report.unchecked) == 7
    assert report.unchecked[0] == (
        f"{PRE}A_log: the trainer's digests hold no 'dp0:pp0:pcp0:tp1:{PRE}A_log' (computed for "
        "another tp_size or model? kda_tp.audit.expected_digests with the engine's layout and "
        "tp_size)")


def test_what_is_no_digest_is_refused():
    with pytest.raises(UsageError, match="got list"):
        checked_digests([("k", "0" * 64)])
    with pytest.raises(UsageError, match=r"entry 'k': 'ABC' is not a SHA-256 hex string"):
        checked_digests({"k": "ABC"})
    assert checked_digests({"k": "0" * 64}) == {"k": "0" * 64}
