// Package layout holds no code. Its test keeps the module's layout as
// docs/architecture.md draws it: the package graph in that page must be the
// one go list reports, and the libraries for others must not pull in what
// they have no use for (the engine-side publisher no monitor, busy-set
// writer or Prometheus client; the router side no monitor).
package layout
