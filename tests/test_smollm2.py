"""default_model.py, which writes the real checkpoint's folder (the README's first model): its files' modes."""
import os

import torch

import default_model


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
