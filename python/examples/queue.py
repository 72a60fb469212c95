"""A persistent FIFO queue in a directory (bigqueue's quick start, in Python).

    python queue.py [DIR]
"""

import sys
import tempfile

import petrel

path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/queue"

with petrel.Queue(path) as q:
    for word in (b"alpha", b"beta", b"gamma"):
        q.put(word)
    print("queued:", q.qsize())
    print("first out:", q.get(timeout=0))

# Reopened, the queue goes on where it was: what was taken stays taken.
with petrel.Queue(path) as q:
    rest = []
    while (item := q.get(timeout=0)) is not None:
        rest.append(item)
    print("after a reopen:", rest)
    assert rest == [b"beta", b"gamma"]
