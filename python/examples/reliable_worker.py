"""Reliable reads against a server (Kestrel's tentative get, in Python): a job taken and not
acknowledged comes back for the next worker; acknowledged, it is gone.

    petrel serve &
    python reliable_worker.py [--server 127.0.0.1:22134]
"""

import argparse
import asyncio

import petrel

parser = argparse.ArgumentParser()
parser.add_argument("--server", default="127.0.0.1:22134")
server = parser.parse_args().server

with petrel.Client(server) as client:
    client.create_queue("py-jobs", durable=True)
    client.offer("py-jobs", b"resize image 42")

    job = client.take("py-jobs", visibility=30)
    print("took", job.payload, "- and gave it back")
    client.abort("py-jobs", [job.handle])

    job = client.take("py-jobs", visibility=30)
    print("took", job.payload, "again - done with it")
    client.ack("py-jobs", [job.handle])
    assert client.poll("py-jobs", timeout=0) is None


async def producers_and_a_consumer():
    async with petrel.AsyncClient(server) as client:
        await asyncio.gather(*(client.offer("py-jobs", b"job %d" % i) for i in range(100)))
        done = 0
        while (job := await client.poll("py-jobs", timeout=0.5)) is not None:
            done += 1
        print("asyncio: offered 100 at once, consumed", done)
        assert done == 100


asyncio.run(producers_and_a_consumer())
