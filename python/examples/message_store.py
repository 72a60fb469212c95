"""A keyed, timed message store (klevdb's quick start, in Python): records by offset, the last
record with a key, the first record at or after a time.

    python message_store.py [DIR]
"""

import sys
import tempfile
import time

import petrel

path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/store"

with petrel.Log(path, key_index=True) as store:
    store.append(b"val1", key=b"key1")
    store.append(b"val2", key=b"key1")
    # Record times come from a coarse clock (a few ms): leave room on both sides of the middle.
    time.sleep(0.05)
    middle = time.time_ns()
    time.sleep(0.05)
    store.append(b"val3", key=b"key2")
    print("next offset:", store.next_offset)

    for record in store:
        print(record.offset, record.key, record.payload)
    print("last with key1:", store.get_by_key(b"key1").payload)
    print("first at or after the middle:", store.get_by_time(middle).payload)
    assert store.get_by_key(b"key1").payload == b"val2"
    assert store.get_by_time(middle).payload == b"val3"
