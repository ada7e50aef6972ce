"""The startup calibration's child (``python -m sglang_ecospec.calibration_child``) on the tiny
Qwen2-MoE target: the argv that ``startup_calibration`` builds calibrates and writes the
profile; a bad flag exits with status 2 and the reason."""

import pytest
import torch
from _models import AUX, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, VOCAB, eagle3_draft, tiny_target
from sglang_ecospec import calibration_child, startup_calibration
from sglang_ecospec.settings import EcoSpecSettings
from sglang_ecospec.startup_calibration import ServedModel

from sgl_ecospec.costmodel.calibration import CalibrationProfile

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> ServedModel:
    root = tmp_path_factory.mktemp("child")
    tiny_target().save_pretrained(root / "target")
    draft = eagle3_draft(torch.ones(VOCAB), HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, 256, AUX, 0.05)
    draft.save_pretrained(root / "draft")
    cpu = torch.device("cpu")
    return ServedModel(str(root / "target"), str(root / "draft"), torch.float32, cpu)


def test_the_child_calibrates_with_the_flags_startup_calibration_gives_it(served, tmp_path, capsys):
    settings = EcoSpecSettings(
        eps="auto",
        calibrate=True,
        calibrate_batch_sizes="1,2",
        calibrate_tokens="1,3",
        calibrate_unique_experts="4,12",
        calibrate_repeats=1,
    )
    out = tmp_path / "profile.json"
    argv = startup_calibration.calibrate_command(served, settings, out)
    assert argv[1:3] == ["-m", "sglang_ecospec.calibration_child"]
    assert calibration_child.main(argv[3:]) == 0
    assert "residuals: rms" in capsys.readouterr().out
    profile = CalibrationProfile.load(out)
    assert profile.fixed == ()  # the draft was timed too
    assert profile.grid.batch_sizes == (1, 2) and profile.grid.repeats == 1
    assert profile.command.startswith(f"sgl-ecospec calibrate --target {served.model_path}")
    assert profile.model.name == "/".join(served.model_path.split("/")[-2:])


def test_a_bad_flag_exits_2_with_the_reason(served, tmp_path, capsys):
    argv = ["--target", served.model_path, "--unique-experts", "4,99"]
    assert calibration_child.main([*argv, "--out", str(tmp_path / "p.json")]) == 2
    assert "unique_experts [99] exceed the model's 16 experts" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
