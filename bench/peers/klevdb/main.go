// Publish N messages to klev-dev/klevdb one at a time, then consume them all in batches: the
// workload of `petrel bench log`, on a peer. Default options: no index, no AutoSync (page cache).
package main

import (
	"fmt"
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
	keyed := f.Keys > 0
	db, err := klevdb.Open(dir, klevdb.Options{CreateDirs: true, KeyIndex: keyed, TimeIndex: keyed})
	if err != nil {
		result.Fail(err)
	}
	msg := []klevdb.Message{{Time: time.Now(), Value: payload}}
	start := time.Now()
	for i := 0; i < f.Count; i++ {
		if keyed {
			msg[0].Key = []byte(fmt.Sprintf("k%d", i%f.Keys))
			msg[0].Time = time.Now()
		}
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
	rates := map[string]float64{
		"append_msgs_per_sec": result.Rate(f.Count, appendTime),
		"read_msgs_per_sec":   result.Rate(f.Count, readTime),
	}

	rng := result.XorShift(0x9E3779B97F4A7C15)
	start = time.Now()
	for i := 0; i < f.Lookups; i++ {
		if _, err := db.Get(int64(rng.Below(uint64(f.Count)))); err != nil {
			result.Fail(err)
		}
	}
	rates["get_by_offset_per_sec"] = result.Rate(f.Lookups, time.Since(start))

	if keyed {
		first, _ := db.Get(0)
		last, _ := db.Get(int64(f.Count - 1))
		span := uint64(last.Time.Sub(first.Time).Nanoseconds()) + 1
		start = time.Now()
		for i := 0; i < f.Lookups; i++ {
			t := first.Time.Add(time.Duration(rng.Below(span)))
			if _, err := db.GetByTime(t); err != nil {
				result.Fail(err)
			}
		}
		rates["get_by_time_per_sec"] = result.Rate(f.Lookups, time.Since(start))
		start = time.Now()
		for i := 0; i < f.Lookups; i++ {
			if _, err := db.GetByKey([]byte(fmt.Sprintf("k%d", rng.Below(uint64(f.Keys))))); err != nil {
				result.Fail(err)
			}
		}
		rates["get_by_key_per_sec"] = result.Rate(f.Lookups, time.Since(start))
	}
	db.Close()
	result.Print("klevdb v0.12.1", f, rates, map[string]any{"keys": f.Keys})
}
