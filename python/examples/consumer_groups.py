"""An append-only log read by two independent consumer groups with acknowledgements (k7's quick
start, in Python): each group keeps its own position, across reopens; an unacknowledged record
is delivered again.

    python consumer_groups.py [DIR]
"""

import sys
import tempfile

import petrel

path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/log"

with petrel.Log(path, durability="always") as log:
    log.append_batch([b"order %d" % i for i in range(5)])

    billing = log.group("billing")
    shipping = log.group("shipping")
    for group in (billing, shipping):
        group.seek("oldest")

    # billing handles everything; shipping handles two and leaves the third unacknowledged.
    for record in billing.poll(10, timeout=0):
        billing.ack(record.offset)
    for record in shipping.poll(3, timeout=0)[:2]:
        shipping.ack(record.offset)
    print("billing at", billing.committed, "- shipping at", shipping.committed)
    billing.close()
    shipping.close()

with petrel.Log(path) as log:
    shipping = log.group("shipping")
    again = [r.payload for r in shipping.poll(10, timeout=0)]
    print("shipping after a reopen:", again)
    assert again == [b"order 2", b"order 3", b"order 4"]
    assert log.group("billing").poll(10, timeout=0) == []
