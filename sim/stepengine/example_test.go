package stepengine_test

import (
	"fmt"
	"time"

	"github.com/workermon/workermon/sim/stepengine"
)

// A caller owns the engine on one goroutine: it adds requests as they
// arrive, begins a step, waits on the wall clock until the step's end (here
// the time is only simulated), and ends it to deliver the tokens.
func Example() {
	p, err := stepengine.LookupProfile(stepengine.ProfileTiny)
	if err != nil {
		panic(err)
	}
	e, err := stepengine.New(p.Config)
	if err != nil {
		panic(err)
	}
	start := time.Unix(0, 0)
	a, _ := e.Add(start, 300, 3)
	b, _ := e.Add(start, 100, 2)
	names := map[*stepengine.Request]string{a: "a", b: "b"}

	now := start
	for e.Busy() {
		end, _ := e.Begin(now)
		// A real caller waits here: time.NewTimer(time.Until(end)), while it
		// takes arrivals and cancellations.
		for _, ev := range e.End() {
			switch {
			case ev.First():
				fmt.Printf("%s: first token at %v (TTFT %v)\n", names[ev.Request], ev.At.Sub(start), ev.Latency)
			case ev.Kind == stepengine.EventToken:
				fmt.Printf("%s: token %d at %v (ITL %v)\n", names[ev.Request], ev.Token, ev.At.Sub(start), ev.Latency)
			case ev.Kind == stepengine.EventFinished:
				fmt.Printf("%s: finished (e2e %v)\n", names[ev.Request], ev.Latency)
			}
		}
		now = end
	}
	fmt.Println("blocks held:", e.Load().BlocksUsed)
	// Output:
	// a: first token at 37ms (TTFT 37ms)
	// b: first token at 37ms (TTFT 37ms)
	// a: token 2 at 50.8ms (ITL 13.8ms)
	// b: token 2 at 50.8ms (ITL 13.8ms)
	// b: finished (e2e 50.8ms)
	// a: token 3 at 63.902ms (ITL 13.102ms)
	// a: finished (e2e 63.902ms)
	// blocks held: 0
}
