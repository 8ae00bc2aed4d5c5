"""``zeroshard report``: every section present, statuses coloured only when asked, nothing fails."""

from __future__ import annotations

import pytest

from zeroshard.cli import report


def test_sections_and_checks() -> None:
    sections = dict(report.collect())
    assert list(sections) == ["general", "accelerators", "torch.distributed backends", "features", "packages"]
    labels = {c.label for checks in sections.values() for c in checks}
    for label in ("zeroshard", "python", "torch", "NCCL", "cuDNN", "gloo", "nccl", "pinned memory",
                  "async I/O (NVMe offload)", "fast CPU optimizer", "transformers", "accelerate", "tensorboard",
                  "wandb"):
        assert label in labels, label
    statuses = {c.status for checks in sections.values() for c in checks}
    assert statuses <= {report.OKAY, report.NO, report.WARN, report.INFO}
    gloo = next(c for c in sections["torch.distributed backends"] if c.label == "gloo")
    assert gloo.status == report.OKAY  # every torch build this project supports has gloo


def test_versions_match_the_installed_packages() -> None:
    import torch

    import zeroshard

    checks = {c.label: c for _, cs in report.collect() for c in cs}
    assert checks["zeroshard"].detail.startswith(zeroshard.__version__)
    assert checks["torch"].detail.startswith(torch.__version__)
    assert checks["pydantic"].status == report.OKAY


def test_render_plain_and_coloured() -> None:
    sections = [("s", [report.Check("a", report.OKAY, "fine"), report.Check("b", report.NO, "missing"),
                       report.Check("c", report.WARN, "hm"), report.Check("d", report.INFO, "text")])]
    plain = report.render(sections, color=False)
    assert "a .... [OKAY] fine" in plain and "b .... [NO] missing" in plain and "d .... text" in plain
    assert "\033[" not in plain
    coloured = report.render(sections, color=True)
    assert "\033[92m[OKAY]\033[0m" in coloured and "\033[91m[NO]\033[0m" in coloured
    assert "\033[93m[WARNING]\033[0m" in coloured


def test_main_color_option(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert report.main(["--color", "always"]) == 0
    assert "\033[" in capsys.readouterr().out
    monkeypatch.setenv("NO_COLOR", "1")
    assert report.main([]) == 0
    assert "\033[" not in capsys.readouterr().out
