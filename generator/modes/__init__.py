"""The kernel modes, one file each; a new mode is a file here plus a line in MODES."""
from __future__ import annotations

from ..plan import Mode
from . import decode, prefill

MODES: dict[str, Mode] = {m.name: m for m in (decode.MODE, prefill.MODE)}
