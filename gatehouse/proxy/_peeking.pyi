# FastStream.peek_walk's loop in C (_peeking.c; see gatehouse/proxy/fastio.py).
from typing import Any

def peek_walk(fd: int, walk: Any, at: int, moved: int, total: int, read: int, /
              ) -> tuple[int, int]: ...
