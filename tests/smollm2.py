"""Writes the real checkpoint's folder (SmolLM2-135M-Instruct, see default_model.py) to DEST.

    python tests/smollm2.py DEST      # needs transformers and gguf (the test extra): pip install transformers gguf
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # default_model.py, from a clone not installed
import default_model  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/smollm2.py DEST")
    print(default_model.convert(sys.argv[1]))
