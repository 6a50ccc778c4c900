package events

import "strconv"

// Partition returns the partition of a model among n (contract §10): the
// FNV-1a 32-bit hash of its model_key, modulo n. It is what the NATS
// servers' {{partition(n,1)}} subject mapping computes on the model_key
// token. n below 2 means one partition, 0.
func Partition(model string, n int) int {
	return PartitionOfKey(ModelKey(model), n)
}

// PartitionOfKey is Partition for a model_key token, as it arrives in a
// subject. It allocates nothing.
func PartitionOfKey(key string, n int) int {
	if n < 2 {
		return 0
	}
	const offset, prime = 2166136261, 16777619 // FNV-1a, 32 bits
	h := uint32(offset)
	for i := 0; i < len(key); i++ {
		h ^= uint32(key[i])
		h *= prime
	}
	return int(h % uint32(n))
}

// PartitionWildcard subscribes to every mapped subject of partition p:
// <prefix>.part.<p>.>.
func PartitionWildcard(prefix string, p int) string {
	return prefix + ".part." + strconv.Itoa(p) + ".>"
}

// Mapping is one subject mapping of a NATS account.
type Mapping struct{ From, To string }

// PartitionMappings returns the subject mappings every NATS server of a
// deployment with n partitions carries (contract §10): load, bye and est
// subjects (and the latency windows of §18, lat and latr, and the routers'
// queues of §22, rq) move under <prefix>.part.<p>, p computed from the
// model_key token. Publishers keep publishing on the plain subjects.
func PartitionMappings(prefix string, n int) []Mapping {
	part := prefix + ".part.{{partition(" + strconv.Itoa(n) + ",1)}}."
	return []Mapping{
		{prefix + ".load.*.*.*", part + "load.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}"},
		{prefix + ".bye.*.*", part + "bye.{{wildcard(1)}}.{{wildcard(2)}}"},
		{prefix + ".est.*.*.*", part + "est.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}"},
		{prefix + ".lat.*.*", part + "lat.{{wildcard(1)}}.{{wildcard(2)}}"},
		{prefix + ".latr.*.*", part + "latr.{{wildcard(1)}}.{{wildcard(2)}}"},
		{prefix + ".rq.*", part + "rq.{{wildcard(1)}}"},
	}
}
