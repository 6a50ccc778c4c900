// Package integration tests workermon across containers: the images built by
// `make images` (workermon:dev and workermon-nats:dev) run as a NATS server
// or cluster, the monitor, simulated engines and the router on networks the
// tests create, and the tests break them for real: overload, a NATS restart,
// a monitor restart, a killed worker, a worker cut from the network, the loss
// of one node of a three-node NATS cluster, a worker's NATS credentials used
// to speak for another worker.
//
// The tests carry the build tag "integration" and need Docker; without it
// they fail rather than skip. They never pull an image. Run them with
//
//	make integration
//
// which builds the images first. Every step is logged (go test -v) so that a
// run reads as evidence of what was broken and what was observed.
package integration
