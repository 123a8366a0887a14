"""What an optimisation that fails to build leaves behind: one line naming the cause (for the log, `/health`,
the panel and the page's banner), and one answer for every rank of a group (all of them fall back, or
none)."""

from __future__ import annotations

import re

from imgedit.errors import ImgEditError


def cause(exc: BaseException, limit: int = 200) -> str:
    """The cause of a failure as one line: the exception under our own wrapping (the runner turns an
    unexpected one into "internal error"), its type and the first line of its text (dynamo's run to pages)."""
    while isinstance(exc, ImgEditError):
        inner = exc.__cause__ or exc.__context__ or getattr(exc, "error", None)
        if inner is None or inner is exc:
            break
        exc = inner
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    # dynamo names where it stopped after "from user code:"; the last frame is the code it could not trace
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', text.partition("from user code:")[2])
    if frames:
        path, function = frames[-1]
        line += f" (in {'/'.join(path.split('/')[-2:])}, {function})"
    return f"{type(exc).__name__}: {line}"[:limit]


def agreed(failure: BaseException | None, agree, what: str) -> BaseException | None:
    """This rank's failure, or, where it built fine and another rank of its group did not, one saying so.
    `agree(ok)` is the group's vote (true only if true on every rank; None outside a group): every rank
    of the group must call this, whatever happened to it."""
    if agree is not None and not agree(failure is None) and failure is None:
        return RuntimeError(f"another rank of this group could not build {what}")
    return failure
