"""What both demo scripts take on the command line: ``--attn flash|eager``, ``--device``, ``--dtype``."""

import argparse

import torch


def options() -> argparse.Namespace:
    """The parsed options; gradients off, as TransformerLens's demos set them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--attn", default="flash", choices=["flash", "eager"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    torch.set_grad_enabled(False)
    return parser.parse_args()
