// Package result prints a peer benchmark's figures in the shape `petrel bench log --json` uses.
package result

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// Flags common to every peer program.
type Flags struct {
	Dir          string
	Count        int
	PayloadBytes int
	Keys         int
	Lookups      int
}

func Parse() Flags {
	var f Flags
	flag.StringVar(&f.Dir, "dir", os.TempDir(), "parent directory for the store (a fresh subdirectory is used and removed)")
	flag.IntVar(&f.Count, "count", 1_000_000, "messages to enqueue, then dequeue")
	flag.IntVar(&f.PayloadBytes, "payload-bytes", 32, "bytes per message")
	flag.IntVar(&f.Keys, "keys", 0, "give messages keys k0..k{N-1} and measure lookups (0: no keys)")
	flag.IntVar(&f.Lookups, "lookups", 1_000_000, "random lookups per lookup phase")
	flag.Parse()
	return f
}

// Workdir makes a fresh directory for one run.
func (f Flags) Workdir(name string) string {
	dir := filepath.Join(f.Dir, fmt.Sprintf("peer-%s-%d", name, os.Getpid()))
	os.RemoveAll(dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		Fail(err)
	}
	return dir
}

func (f Flags) Payload() []byte {
	p := make([]byte, f.PayloadBytes)
	for i := range p {
		p[i] = byte(i*7 + 1)
	}
	return p
}

// Print writes one JSON object: the peer's name, the workload and every rate measured.
func Print(peer string, f Flags, rates map[string]float64, extra map[string]any) {
	out := map[string]any{"peer": peer, "count": f.Count, "payload_bytes": f.PayloadBytes}
	for k, v := range rates {
		out[k] = v
	}
	for k, v := range extra {
		out[k] = v
	}
	b, _ := json.Marshal(out)
	fmt.Println(string(b))
}

// XorShift is the same small generator `petrel bench log` uses for lookup positions.
type XorShift uint64

func (x *XorShift) Below(n uint64) uint64 {
	*x ^= *x << 13
	*x ^= *x >> 7
	*x ^= *x << 17
	return uint64(*x) % n
}

// Rate is operations per second.
func Rate(n int, d time.Duration) float64 { return float64(n) / d.Seconds() }

func Fail(err error) {
	fmt.Fprintln(os.Stderr, "peer benchmark failed:", err)
	os.Exit(1)
}

// DiskUsage is the bytes allocated on disk to the files under dir (as `petrel bench log` counts
// them: blocks, not apparent sizes).
func DiskUsage(dir string) int64 {
	var total int64
	filepath.Walk(dir, func(_ string, info os.FileInfo, err error) error {
		if err == nil && !info.IsDir() {
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				total += st.Blocks * 512
			}
		}
		return nil
	})
	return total
}
