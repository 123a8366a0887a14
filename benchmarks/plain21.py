"""Plain diffusers' `QwenImage21Pipeline` on this card: the anchor that Qwen-Image-2.1's acceptance rows are
measured against. The same checkpoint (real-size random weights, as acceptance.py builds it), the same requests
(acceptance.py's prompt and pictures, 1024², 40 steps, CFG off, 0 / 1 / 3 / 5 / 10 references), called bare:
bf16 on one GPU, eager, diffusers' own defaults (its prefix KV cache included), no server. Each request twice
(the first call and a steady one); every image must be finite.

With `--acceptance FILE` (acceptance.py's `--json` of a 2.1 row run on the same card, e.g. the same machine just
before): imgedit's seconds over REST (upload, queue and PNG reply included) against the plain call's, per request.

    python3 benchmarks/plain21.py --checkpoint /tmp/qwen-image-2.1-real-random \\
        --acceptance /tmp/res/acc-21-one.json --json /tmp/res/plain21.json
    python3 benchmarks/plain21.py --device cpu --size tiny --side 384 --steps 2 --checkpoint /tmp/t21  # it runs
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import PROMPT, input_picture  # noqa: E402
from probe_21_compile import load  # noqa: E402

# (the acceptance row's request name, its number of references); text to image's steady call is "t2i-steady"
REQUESTS = (("t2i-steady", 0), ("refs1", 1), ("refs3", 3), ("refs5", 5), ("refs10-full", 10))


def timed_call(pipe, device: str, side: int, steps: int, pictures: list) -> tuple[float, bool]:
    """One call as acceptance.py's request asks it (seed 1): its seconds, and whether the image is finite."""
    import numpy as np
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = pipe(prompt=PROMPT, image=pictures or None, width=side, height=side, num_inference_steps=steps,
                   output_resolution=side, generator=torch.Generator().manual_seed(1), output_type="np").images
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, bool(np.isfinite(np.asarray(out)).all())


def ours(path: str | None) -> dict[str, float]:
    """{request name: seconds} of the acceptance run's 2.1 row (its first row with these requests)."""
    if not path:
        return {}
    for row in json.loads(Path(path).read_text())["rows"]:
        seconds = {r["name"]: r["seconds"] for r in row["requests"] if r.get("outcome") == "ok"}
        if "t2i-steady" in seconds:
            return seconds
    return {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen-image-2.1-real-random")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=("tiny", "real"), default="real")
    parser.add_argument("--side", type=int, default=1024, help="the output's side (acceptance.py's --size)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--acceptance", help="acceptance.py's --json of a 2.1 row on this card")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from PIL import Image

    pipe = load(SimpleNamespace(device=args.device, size=args.size, checkpoint=args.checkpoint))
    # acceptance.py's references: ten different sizes and contents
    pictures = [Image.open(io.BytesIO(input_picture(args.side // 2 + 16 * k))).convert("RGB") for k in range(10)]
    theirs = ours(args.acceptance)
    rows = []
    for name, count in REQUESTS:
        first, first_finite = timed_call(pipe, args.device, args.side, args.steps, pictures[:count])
        steady, steady_finite = timed_call(pipe, args.device, args.side, args.steps, pictures[:count])
        row = dict(request=name, references=count, plain_first_s=round(first, 3), plain_steady_s=round(steady, 3),
                   finite=first_finite and steady_finite)
        if name in theirs:
            row.update(imgedit_s=theirs[name], plain_over_imgedit=round(steady / theirs[name], 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
        assert row["finite"], f"plain diffusers gave a non-finite image for {name}"
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), command=" ".join(sys.argv),
            device=args.device, steps=args.steps, side=args.side, acceptance=args.acceptance, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
