"""default_model.py: the model a run without --model gets (SmolLM2-135M-Instruct, converted once into tinyflow's
cache folder), and the real checkpoint's folder of the tests. No test here downloads or converts anything."""
import os
import sys

import pytest
import torch

import default_model
import model
from test_generate import cli


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """$TINYFLOW_CACHE at an empty folder, and a converter that fails the test if anything calls it."""
    monkeypatch.setenv("TINYFLOW_CACHE", str(tmp_path))

    def no_conversion(dest):
        raise AssertionError("converted although no conversion was due")
    monkeypatch.setattr(default_model, "convert", no_conversion)
    return tmp_path


def test_the_weights_file_gets_the_mode_of_the_folders_other_files(tmp_path):
    """safetensors alone writes 0600: another user of the machine could not load the model."""
    old = os.umask(0o022)
    try:
        default_model.save_weights({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text("{}")
    finally:
        os.umask(old)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in tmp_path.iterdir()}
    assert modes == {"model.safetensors": "0o644", "config.json": "0o644"}


def test_no_model_is_the_folder_in_the_cache_and_a_finished_one_is_reused(cache, capsys):
    folder = cache / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # written last by a conversion: the folder is finished
    assert model.resolve(None) == str(folder)
    assert capsys.readouterr().err == f"no model given: running SmolLM2-135M-Instruct ({folder})\n"


@pytest.mark.parametrize("missing", ["gguf", "transformers"])
def test_no_model_without_the_conversions_packages_is_one_line_naming_the_pip_install(cache, capsys, monkeypatch,
                                                                                     missing):
    monkeypatch.setitem(sys.modules, missing, None)  # importlib.util.find_spec: not installed
    code, out, err = cli(capsys, "--prompt", "Hello", "--device", "cpu", "--no-compile")
    assert code == 2 and out == ""
    assert err == (f"error: no --model given, and converting the default model (SmolLM2-135M-Instruct) needs "
                   f"{missing}: pip install {missing} (or give --model)\n")
    assert list(cache.iterdir()) == []  # nothing half-made left behind


def test_an_interrupted_conversion_leaves_no_folder_behind(tmp_path):
    dest = tmp_path / "models" / "SmolLM2-135M-Instruct"

    def interrupted(folder):
        open(os.path.join(folder, "model.safetensors"), "w").close()
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        default_model.build_atomically(dest, interrupted)
    assert list((tmp_path / "models").iterdir()) == []


def test_a_finished_conversion_is_renamed_into_place_readable_by_all(tmp_path):
    dest = tmp_path / "models" / "SmolLM2-135M-Instruct"
    old = os.umask(0o022)
    try:
        default_model.build_atomically(dest, lambda folder: open(os.path.join(folder, "config.json"), "w").close())
    finally:
        os.umask(old)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [dest.name]
    assert (dest / "config.json").exists() and oct(dest.stat().st_mode & 0o777) == "0o755"


def test_a_cache_folder_that_cannot_be_written_is_one_line_saying_what_to_set(cache, monkeypatch, capsys):
    (cache / "file").write_text("")  # a file where the cache's folders would go
    monkeypatch.setenv("TINYFLOW_CACHE", str(cache / "file"))
    code, out, err = cli(capsys, "--prompt", "Hello", "--device", "cpu", "--no-compile")
    assert code == 2 and out == ""
    assert err == (f"error: cannot make the default model's folder {cache / 'file' / 'models'} (Not a directory); "
                   f"set $TINYFLOW_CACHE to a folder you can write, or give --model\n")
