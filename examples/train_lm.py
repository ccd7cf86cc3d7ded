"""Train a small GPT-style language model on clops: ``python examples/train_lm.py [--steps N] [--plot loss.png]``.

The same as ``python -m clops train-demo``; the model, its backward and the PyTorch check are in
``clops/train_demo.py``. Needs CLBlast for the matmuls (Debian/Ubuntu: ``apt install libclblast1``).
"""
import sys

from clops.train_demo import main

if __name__ == "__main__":
    sys.exit(main())
