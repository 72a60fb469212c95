// Enqueue N messages into grandecola/bigqueue, then dequeue them all: the workload of
// `petrel bench log`, on a peer. Default options: mmap arenas, no periodic flush (page cache).
package main

import (
	"bytes"
	"os"
	"time"

	"github.com/grandecola/bigqueue"
	"petrel.bench/peers/internal/result"
)

func main() {
	f := result.Parse()
	dir := f.Workdir("bigqueue")
	defer os.RemoveAll(dir)
	payload := f.Payload()
	q, err := bigqueue.NewMmapQueue(dir)
	if err != nil {
		result.Fail(err)
	}
	start := time.Now()
	for i := 0; i < f.Count; i++ {
		if err := q.Enqueue(payload); err != nil {
			result.Fail(err)
		}
	}
	appendTime := time.Since(start)

	start = time.Now()
	for i := 0; i < f.Count; i++ {
		m, err := q.Dequeue()
		if err != nil {
			result.Fail(err)
		}
		if len(m) != len(payload) {
			result.Fail(bytes.ErrTooLarge)
		}
	}
	readTime := time.Since(start)

	// A named consumer reads everything again from the start (bigqueue's consumer API, the
	// counterpart of a Petrel consumer group's poll + ack).
	c, err := q.NewConsumer("bench")
	if err != nil {
		result.Fail(err)
	}
	start = time.Now()
	for i := 0; i < f.Count; i++ {
		if _, err := c.Dequeue(); err != nil {
			result.Fail(err)
		}
	}
	consumerTime := time.Since(start)
	q.Close()
	result.Print("bigqueue v0.6.0", f, map[string]float64{
		"append_msgs_per_sec":   result.Rate(f.Count, appendTime),
		"read_msgs_per_sec":     result.Rate(f.Count, readTime),
		"poll_ack_msgs_per_sec": result.Rate(f.Count, consumerTime),
	}, map[string]any{"bytes_on_disk": result.DiskUsage(dir)})
}
