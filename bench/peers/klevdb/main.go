// Publish N messages to klev-dev/klevdb one at a time, then consume them all in batches: the
// workload of `petrel bench log`, on a peer. Default options: no index, no AutoSync (page cache).
package main

import (
	"os"
	"time"

	"github.com/klev-dev/klevdb"
	"petrel.bench/peers/internal/result"
)

const consumeBatch = 4096

func main() {
	f := result.Parse()
	dir := f.Workdir("klevdb")
	defer os.RemoveAll(dir)
	payload := f.Payload()
	db, err := klevdb.Open(dir, klevdb.Options{CreateDirs: true})
	if err != nil {
		result.Fail(err)
	}
	msg := []klevdb.Message{{Time: time.Now(), Value: payload}}
	start := time.Now()
	for i := 0; i < f.Count; i++ {
		if _, err := db.Publish(msg); err != nil {
			result.Fail(err)
		}
	}
	appendTime := time.Since(start)

	start = time.Now()
	read := 0
	offset := klevdb.OffsetOldest
	for read < f.Count {
		next, msgs, err := db.Consume(offset, consumeBatch)
		if err != nil {
			result.Fail(err)
		}
		read += len(msgs)
		offset = next
	}
	readTime := time.Since(start)
	db.Close()
	result.Print("klevdb v0.12.1", f, map[string]float64{
		"append_msgs_per_sec": result.Rate(f.Count, appendTime),
		"read_msgs_per_sec":   result.Rate(f.Count, readTime),
	}, nil)
}
