package events

import (
	"errors"
	"testing"
)

func TestMigrateCodec(t *testing.T) {
	t.Parallel()
	r := MigrateRequest{Model: "Qwen/Qwen3-0.6B", Src: 3, Dst: 4, DstEndpoint: "http://w4:8000", MaxRequests: 1,
		Reason: MigrateReasonDecodeLoad, Epoch: 7}
	data, err := MarshalMigrateRequest(r)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeMigrateRequest(data)
	r.V = 1
	if err != nil || got != r {
		t.Fatalf("round trip %+v, %v; want %+v", got, err, r)
	}
	if MigrateSubject("workermon", r.Model, 3) != "workermon.migrate.Qwen/Qwen3-0=2E6B.3" {
		t.Errorf("subject %q", MigrateSubject("workermon", r.Model, 3))
	}
	for name, bad := range map[string]MigrateRequest{
		"to itself":     {Model: "m", Src: 1, Dst: 1},
		"invalid model": {Model: "", Src: 1, Dst: 2},
	} {
		if _, err := MarshalMigrateRequest(bad); err == nil {
			t.Errorf("%s: encoded", name)
		}
	}
	if _, err := DecodeMigrateRequest([]byte{0xc1}); !errors.Is(err, ErrMalformed) {
		t.Errorf("garbage: %v", err)
	}
	reply, _ := MarshalMigrateReply(MigrateReply{Migrated: 2})
	if got, err := DecodeMigrateReply(reply); err != nil || got.Migrated != 2 {
		t.Errorf("reply %+v, %v", got, err)
	}
}
