"""``glm5 check``: a good checkpoint passes with its layer summary, a damaged one lists its problems."""

from __future__ import annotations

import json
import shutil

from glm5.cli import main


def test_check_reports_a_good_checkpoint(tiny_checkpoint_dir, capsys):
    assert main(["check", str(tiny_checkpoint_dir), "--require-mtp"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["kda_layers"] == 5 and report["mla_layers"] == 3 and report["mtp_layers"] == 1
    assert report["tensors"] > 100 and report["vision"]


def test_check_fails_on_a_truncated_weights_file(tiny_checkpoint_dir, tmp_path, capsys):
    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "glm5 check:" in err


def test_check_fails_on_a_bad_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "index_topk": 10, "index_kpool": 4}))
    assert main(["check", str(tmp_path)]) == 1
    assert "index_topk" in capsys.readouterr().err
