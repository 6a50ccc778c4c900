//go:build integration

package integration

import (
	"context"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/moby/moby/client"
	"github.com/testcontainers/testcontainers-go"
)

// Images the tests run; `make images` builds them. IMAGE_TAG picks another
// tag than dev.
var (
	workermonImage = "workermon:" + imageTag()
	natsImage      = "workermon-nats:" + imageTag()
)

func imageTag() string {
	if tag := os.Getenv("IMAGE_TAG"); tag != "" {
		return tag
	}
	return "dev"
}

// docker is the Docker client of the tests: images, kill, network
// disconnect.
var docker *testcontainers.DockerClient

func TestMain(m *testing.M) {
	// No reaper container: it would have to be pulled. Every test removes
	// its containers and networks itself.
	os.Setenv("TESTCONTAINERS_RYUK_DISABLED", "true")
	if err := setup(); err != nil {
		fmt.Fprintf(os.Stderr, "integration: %v\n", err)
		os.Exit(1)
	}
	code := m.Run()
	_ = docker.Close()
	os.Exit(code)
}

// setup connects to Docker, checks that the images are there (never pulls)
// and decides where the mapped ports of containers are reached.
func setup() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var err error
	docker, err = testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		return fmt.Errorf("Docker is not reachable (the integration tests need it): %w", err)
	}
	info, err := docker.Info(ctx, client.InfoOptions{})
	if err != nil {
		return fmt.Errorf("Docker is not reachable (the integration tests need it): %w", err)
	}
	fmt.Fprintf(os.Stderr, "integration: Docker %s (%s), %d CPUs\n",
		info.Info.ServerVersion, info.Info.OperatingSystem, info.Info.NCPU)
	for _, img := range []string{workermonImage, natsImage} {
		if _, err := docker.ImageInspect(ctx, img); err != nil {
			return fmt.Errorf("image %s is missing: run `make images` first (the tests never pull): %w", img, err)
		}
	}
	return chooseHost(ctx)
}

// chooseHost sets TESTCONTAINERS_HOST_OVERRIDE when the tests run inside a
// container that shares its network namespace with the Docker daemon (the
// daemon's bridge gateway is one of this process's own addresses): the
// mapped ports are then on localhost, while testcontainers would guess the
// default gateway. In a sibling container (socket mounted), testcontainers'
// own guess is kept.
func chooseHost(ctx context.Context) error {
	if _, set := os.LookupEnv("TESTCONTAINERS_HOST_OVERRIDE"); set {
		fmt.Fprintf(os.Stderr, "integration: mapped ports on %s (TESTCONTAINERS_HOST_OVERRIDE)\n", os.Getenv("TESTCONTAINERS_HOST_OVERRIDE"))
		return nil
	}
	if _, err := os.Stat("/.dockerenv"); err != nil {
		return nil // not in a container: testcontainers uses localhost
	}
	res, err := docker.NetworkInspect(ctx, "bridge", client.NetworkInspectOptions{})
	if err != nil {
		return fmt.Errorf("inspect the bridge network: %w", err)
	}
	local := map[string]bool{}
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok {
			local[ipn.IP.String()] = true
		}
	}
	for _, cfg := range res.Network.IPAM.Config {
		// Docker 20.10 leaves the default bridge's gateway out of IPAM: it
		// is then the subnet's first address.
		gw := cfg.Gateway
		if !gw.IsValid() && cfg.Subnet.IsValid() {
			gw = cfg.Subnet.Masked().Addr().Next()
		}
		if gw.IsValid() && local[gw.String()] {
			os.Setenv("TESTCONTAINERS_HOST_OVERRIDE", "localhost")
			fmt.Fprintf(os.Stderr, "integration: in a container that shares the Docker daemon's network (bridge gateway %s is local): mapped ports on localhost\n", gw)
			return nil
		}
	}
	fmt.Fprintln(os.Stderr, "integration: in a container beside the Docker daemon: mapped ports on the gateway testcontainers finds")
	return nil
}
