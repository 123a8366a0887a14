"""PSNR between images of the same requests saved by two acceptance rows (`acceptance.py --save-images DIR`):

    python benchmarks/psnr.py DIR ROW_A ROW_B [--json FILE]

For every REQUEST with both DIR/ROW_A-REQUEST.png and DIR/ROW_B-REQUEST.png (the same prompt, seed and
settings, served by two placements): PSNR in dB over the RGB(A) bytes (inf when identical). A split or
compiled path is judged against one GPU's eager image with it (the 2.1 issue's bar: 38 dB)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from PIL import Image


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("row_a")
    parser.add_argument("row_b")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    folder, results = Path(args.folder), {}
    for path in sorted(folder.glob(f"{args.row_a}-*.png")):
        request = path.name[len(args.row_a) + 1:-4]
        other = folder / f"{args.row_b}-{request}.png"
        if not other.exists():
            continue
        a, b = np.asarray(Image.open(path)), np.asarray(Image.open(other))
        results[request] = None if a.shape != b.shape else round(psnr(a, b), 2)
        print(f"{request:<20} {results[request]} dB")
    if args.json:
        Path(args.json).write_text(json.dumps({"a": args.row_a, "b": args.row_b, "psnr_db": results}, indent=1))


if __name__ == "__main__":
    main()
