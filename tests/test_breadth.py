"""Breadth: every architecture that trains also estimates, plans and checkpoints all its blocks
(issue #27). Each transformers family of `families.FAMILIES` (tiny configs, nothing downloaded)
trains on 2 real gloo ranks with checkpointing none and full, and must show: the stacks of blocks
``blocks=None`` finds, the same weights with and without checkpointing (1e-5), activation bytes
equal to `estimate` to the byte (fp32, dropout 0), and a `plan` whose setting fits its budget
(the lowest peak checkpointing reaches).

The families of `DEFAULT` run always (one of each kind the other tests do not cover: vision,
encoder-decoder, two-tower); the rest are marked ``breadth`` (``pytest --breadth``, or
``python -m bench.breadth``, which tabulates them all). A family that cannot pass is skipped with
its reason, and `test_what_does_not_work_fails_as_its_reason_says` holds that reason to the error
ddpkit gives."""
import pytest

import ddpkit
from ddpkit.runtime.pool import shared_pool
from families import FAMILIES, config, measure

pytest.importorskip("transformers")

DEFAULT = ("vit", "t5", "clip")


@pytest.fixture(scope="module")
def pool():
    return shared_pool(2, "gloo", "cpu")  # the kernel's shared warm ranks, as train's default


def _params():
    for name, fam in FAMILIES.items():
        marks = [pytest.mark.skip(reason=f"{name}: {fam.skip}")] if fam.skip else []
        if name not in DEFAULT and not fam.skip:
            marks.append(pytest.mark.breadth)
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_a_family_trains_estimates_plans_and_checkpoints_every_block(pool, name):
    fam = FAMILIES[name]
    out = measure(name, pool)
    assert out["blocks"] == fam.blocks  # every stack, in the model's order
    assert out["policy_full"] == "every block"
    assert out["trained"] > 1e-4  # the weights moved...
    assert out["weight_diff"] <= 1e-5  # ...the same way with every block checkpointed
    for key in ("none", "full"):
        assert out[f"measured_{key}"] == out[f"estimated_{key}"], (key, out)
    assert out["measured_full"] < out["measured_none"]
    assert out["plan_fits"] and out["plan_peak"] <= out["budget"], out


def test_the_families_cover_every_kind():
    kinds = {fam.kind for name, fam in FAMILIES.items() if not fam.skip}
    assert {"decoder-only", "encoder-only", "encoder-decoder", "vision", "speech",
            "two-tower"} <= kinds
    assert sum(not fam.skip for fam in FAMILIES.values()) >= 10


def test_what_does_not_work_fails_as_its_reason_says():
    # ALBERT calls one shared layer num_hidden_layers times: no stack to find, said at once
    with pytest.raises(ValueError, match=r"TrainConfig.blocks=None: found no repeated blocks in "
                                         r"AlbertForMaskedLM"):
        config("albert")
    # CTC's loss has an output whose size depends on the data: the estimate names the stage,
    # the op and why, and what the user can do
    cfg = config("wav2vec2-ctc")
    with pytest.raises(ddpkit.TraceError, match=r"the forward .* failed: aten._ctc_loss.default "
                                                r"\(its output's size depends on the data\) at "
                                                r"families.py:\d+ in ctc_loss\. What you can do: "
                                                r"ddpkit.train still runs it") as err:
        ddpkit.estimate(cfg)
    assert (err.value.stage, err.value.op) == ("the forward", "aten._ctc_loss.default")
