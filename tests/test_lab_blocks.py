"""The Lab's per-block checkpoint control at 12, 32 and 80 blocks, without a browser (the browser
test checks how it looks and that every toggle is reachable): what its range, 'every' and buttons
pick, the names it shows, one `CheckpointSetting` per edit, and a range edit mid-run landing on
every rank as one change."""
import time

import pytest

import ddpkit
from ddpkit.spec.setting import CheckpointSetting
from test_lab import CFG, rank0_steps, wait_for_steps


def _gpt2(n_layer):
    def make():
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=16, n_head=2, vocab_size=64,
                                          n_positions=32, bos_token_id=0, eos_token_id=0))
    return make


def test_the_block_control_names_every_block_and_picks_ranges():
    """A transformers GPT-2 of 12 blocks: each block's toggle says its index and, in its tooltip,
    the model's own name for it; the range and 'every' pick blocks; the segments slider and the
    per-block control each give the Lab one `CheckpointSetting`, and the line above says it."""
    pytest.importorskip("transformers")
    cfg = ddpkit.TrainConfig(model=_gpt2(12), micro_batch=2, seq_len=16)
    with ddpkit.Lab(cfg) as lab:
        blocks = lab.blocks
        assert lab.block_toggles is blocks.toggles and len(blocks.toggles) == 12
        assert [t.tooltip for t in blocks.toggles] == [
            f"checkpoint transformer.h.{i}" for i in range(12)]
        assert [t.description for t in blocks.toggles] == [str(i) for i in range(12)]
        assert "no checkpointing" in blocks.summary.value and "(0 of 12 blocks)" in blocks.summary.value
        blocks.range.value, blocks.every.value = (2, 9), 3
        before = lab.estimate_html.value
        blocks.on_button.click()
        want = [i in (2, 5, 8) for i in range(12)]
        assert lab.config().checkpoint == want == [t.value for t in blocks.toggles]
        assert lab.config().checkpoint == CheckpointSetting.from_mask(want, 12)
        assert "blocks 2, 5, 8" in blocks.summary.value and "(3 of 12 blocks)" in blocks.summary.value
        assert lab.estimate_html.value != before  # the read-out follows
        blocks.range.value, blocks.every.value = (0, 11), 1
        blocks.on_button.click()
        blocks.range.value = (5, 5)
        blocks.off_button.click()  # clear one block of "every block"
        assert lab.config().checkpoint == [i != 5 for i in range(12)]
        assert "blocks 0-4, 6-11" in blocks.summary.value
        lab.set(segments=3)  # the slider: its segments, shown as the blocks they cover
        assert lab.config().checkpoint == 3 and "3 segments" in blocks.summary.value
        assert [t.value for t in blocks.toggles] == CheckpointSetting.of(3, 12).mask
        blocks.toggles[11].value = True  # one toggle: per block from what the slider showed
        assert lab.config().checkpoint == [True] * 8 + [False] * 3 + [True]
        blocks.range.value = (0, 11)
        blocks.off_button.click()
        assert lab.config().checkpoint.value is None and "no checkpointing" in blocks.summary.value


@pytest.mark.parametrize("n", [32, 80])
def test_the_block_control_scales(n):
    """Every block has its toggle, and a range edit is one change (one estimate, one send)."""
    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=n, width=8, micro_batch=2)
    with ddpkit.Lab(cfg) as lab:
        assert [t.tooltip for t in lab.block_toggles] == [f"checkpoint blocks.{i}" for i in range(n)]
        seen = []
        lab.blocks.on_change(seen.append)
        lab.blocks.range.value, lab.blocks.every.value = (1, n - 1), 2
        lab.blocks.on_button.click()
        assert len(seen) == 1 and seen[0].mask == [i % 2 == 1 for i in range(n)]
        assert lab.config().checkpoint == seen[0]
        assert f"blocks 1-{n - 1}, every 2nd" in lab.blocks.summary.value


def test_a_range_edit_mid_run_lands_as_one_change():
    # steps: enough that the run cannot end before the edit lands, on two loaded cores too (a
    # full run saw it time out; a 400-step run lasts ~5 s alone); the test stops it once landed
    cfg = ddpkit.TrainConfig(**{**CFG, "n_blocks": 12, "width": 8, "steps": 4000, "peak_every": 50})
    with ddpkit.Lab(cfg) as lab:
        lab.run()
        wait_for_steps(lab, 3)
        sent, send = [], lab.sync.send
        lab.sync.send = lambda **kw: (sent.append(kw), send(**kw))
        lab.blocks.range.value, lab.blocks.every.value = (0, 9), 3
        lab.blocks.on_button.click()
        want = [i in (0, 3, 6, 9) for i in range(12)]
        text = str(CheckpointSetting.from_mask(want, 12))  # what the records carry
        deadline = time.monotonic() + 30
        while {m["rank"] for m in list(lab.metrics) if m["checkpoint"] == text} != {0, 1}:
            assert time.monotonic() < deadline, ("the range edit never reached the ranks",
                                                 "run still going" if lab.running else "run ended")
            time.sleep(0.005)
        wait_for_steps(lab, rank0_steps(lab) + 2)
        row = lab.stop()
    assert [kw["checkpoint"] for kw in sent] == [want]
    assert [kind for _, kind in row["changes"]] == ["checkpoint"]
    step = row["changes"][0][0]
    assert [m["checkpoint"] for m in lab.metrics if m["step"] == step] == [text] * 2
    assert f"step {step}: blocks 0-9, every 3rd" in [a.text for a in lab.plots.loss.layout.annotations]


def test_the_block_control_groups_blocks_by_stack():
    """Ready for models with several stacks (an encoder and a decoder): each stack its header and
    grid, the toggles one list in model order, so the setting counts blocks as the model does."""
    import ipywidgets as W

    from ddpkit.lab.blocks import BlockControl

    ctl = BlockControl([("encoder.layer", [f"encoder.layer.{i}" for i in range(3)]),
                        ("decoder.layer", [f"decoder.layer.{i}" for i in range(2)])])
    assert [t.description for t in ctl.toggles] == ["0", "1", "2", "0", "1"]
    assert ctl.toggles[3].tooltip == "checkpoint decoder.layer.0"
    heads = [box.children[0].value for box in ctl.widget.children if isinstance(box, W.VBox)]
    assert heads == ["<code>encoder.layer</code>: 3 blocks", "<code>decoder.layer</code>: 2 blocks"]
    seen = []
    ctl.on_change(seen.append)
    ctl.toggles[3].value = True
    assert seen == [CheckpointSetting.from_mask([False, False, False, True, False], (3, 2))]
    assert "block 3 <span style='color:#666'>(1 of 5 blocks)" in ctl.summary.value
