module petrel.bench/peers

go 1.25.0

require (
	github.com/grandecola/bigqueue v0.6.0
	github.com/klev-dev/klevdb v0.12.1
)

require (
	github.com/gofrs/flock v0.13.0 // indirect
	github.com/grandecola/mmap v0.7.0 // indirect
	github.com/plar/go-adaptive-radix-tree/v2 v2.0.4 // indirect
	golang.org/x/exp v0.0.0-20260410095643-746e56fc9e2f // indirect
	golang.org/x/sys v0.43.0 // indirect
)
