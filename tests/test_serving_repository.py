"""The runtime model repository: shipped configs parsed as Triton ``ModelConfig`` protobufs, edited
and written back (no text surgery), one ``media_caps`` setting for every model that takes media,
and a subset of models served by copying only them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glm5.serving import model_config as mc
from glm5.serving.installation import default_model_repository
from glm5.serving.repository import RepositoryError, prepare_model_repository, repository_models

SHIPPED = default_model_repository()


@pytest.mark.parametrize("model", ["glm5", "preprocess", "glm5_multimodal"])
def test_shipped_configs_round_trip_through_protobuf(model: str):
    cfg = mc.read_config(SHIPPED / model / "config.pbtxt")
    again = mc.parse_config(mc.format_config(cfg))
    assert again == cfg and again.name == model
    assert again.SerializeToString(deterministic=True) == cfg.SerializeToString(deterministic=True)


def test_runtime_repository_fills_model_python_path_and_overrides(tmp_path: Path):
    dest = prepare_model_repository(SHIPPED, tmp_path / "repo", model_dir="/ckpt", python_path=["/a", "/b"],
                                    engine_overrides={"max_num_seqs": "3", "index_cache": "fp8"})
    assert repository_models(dest) == ["glm5", "glm5_multimodal", "preprocess"]
    glm5 = mc.read_config(dest / "glm5" / "config.pbtxt")
    assert mc.get_parameter(glm5, "model") == "/ckpt"
    assert mc.get_parameter(glm5, "python_path") == f"/a{os.pathsep}/b"
    assert mc.get_parameter(glm5, "max_num_seqs") == "3"
    assert mc.get_parameter(glm5, "index_cache") == "fp8"          # added: not in the shipped file
    assert glm5.model_transaction_policy.decoupled and glm5.backend == "glm5"
    pre = mc.read_config(dest / "preprocess" / "config.pbtxt")
    assert mc.get_parameter(pre, "model") == "/ckpt" and mc.get_parameter(pre, "max_num_seqs") is None
    ens = mc.read_config(dest / "glm5_multimodal" / "config.pbtxt")
    assert mc.get_parameter(ens, "python_path") is None and ens.platform == "ensemble"
    assert len(ens.ensemble_scheduling.step) == 2
    for m in ("glm5", "preprocess", "glm5_multimodal"):
        assert (dest / m / "1").is_dir()
    assert (dest / "preprocess" / "1" / "model.py").is_file()


def test_values_that_broke_text_edits_survive(tmp_path: Path):
    """Quotes, backslashes, braces and a key mentioned in a comment: a regex edit mangled these."""
    src = tmp_path / "src"
    (src / "glm5").mkdir(parents=True)
    (src / "glm5" / "config.pbtxt").write_text(
        'name: "glm5"\nbackend: "glm5"\n# parameters { key: "model" value: { string_value: "old" } }\n'
        'parameters {\n  key: "model"\n  value: {\n    string_value: ""\n  }\n}\n')
    odd = '/ckpt/with "quote" \\ and {braces}'
    dest = prepare_model_repository(src, tmp_path / "repo", model_dir=odd, python_path=[],
                                    engine_overrides={"seed": '7"; rm -rf'})
    cfg = mc.read_config(dest / "glm5" / "config.pbtxt")
    assert mc.get_parameter(cfg, "model") == odd
    assert mc.get_parameter(cfg, "seed") == '7"; rm -rf'
    assert list(cfg.parameters).count("model") == 1


def test_media_caps_reach_glm5_and_preprocess(tmp_path: Path):
    caps = '{"max_images": 1, "max_video_frames": 8}'
    for kwargs in ({"media_caps": caps}, {"engine_overrides": {"media_caps": caps}}):
        dest = prepare_model_repository(SHIPPED, tmp_path / "repo", model_dir="/ckpt", python_path=[], **kwargs)
        for model in ("glm5", "preprocess"):
            assert mc.get_parameter(mc.read_config(dest / model / "config.pbtxt"), "media_caps") == caps, model


def test_bad_media_caps_and_conflicts_are_rejected_before_anything_is_written(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown MediaCaps keys"):
        prepare_model_repository(SHIPPED, tmp_path / "r1", model_dir=None, python_path=[],
                                 media_caps='{"max_imagez": 1}')
    with pytest.raises(ValueError, match="not valid JSON"):
        prepare_model_repository(SHIPPED, tmp_path / "r2", model_dir=None, python_path=[], media_caps="{max")
    with pytest.raises(RepositoryError, match="given twice"):
        prepare_model_repository(SHIPPED, tmp_path / "r3", model_dir=None, python_path=[],
                                 media_caps='{"max_images": 1}', engine_overrides={"media_caps": '{"max_images": 2}'})
    assert not any((tmp_path / r).exists() for r in ("r1", "r2", "r3"))


def test_subset_copies_only_the_chosen_models(tmp_path: Path):
    dest = prepare_model_repository(SHIPPED, tmp_path / "repo", model_dir="/ckpt", python_path=[], models=("glm5",))
    assert repository_models(dest) == ["glm5"]
    with pytest.raises(RepositoryError, match="nosuch"):
        prepare_model_repository(SHIPPED, tmp_path / "r2", model_dir=None, python_path=[], models=("nosuch",))


def test_malformed_config_names_the_file_and_position(tmp_path: Path):
    bad = tmp_path / "config.pbtxt"
    bad.write_text('name: "x"\nparameters { key: "model" value: { string_valu: "" } }\n')
    with pytest.raises(mc.ModelConfigError, match=r"config.pbtxt.*2:"):
        mc.read_config(bad)


def test_openai_client_spells_the_admin_key_names_like_the_launcher():
    """The OpenAI server cannot import glm5.serving (that would be an import cycle): the names must agree."""
    from glm5.entrypoints.openai import triton_client
    from glm5.serving import access

    assert triton_client.ADMIN_KEY_ENV == access.ADMIN_KEY_ENV
    assert triton_client.ADMIN_GRPC_METADATA == access.GRPC_HEADER_PREFIX + access.ADMIN_HEADER
