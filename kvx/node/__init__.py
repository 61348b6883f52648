"""``kvx node``: one KV pool per host in shared memory, shared by every engine on it (:mod:`.daemon`), and the
engines' side of it (:mod:`.client`). Frames and the pool file's layout: :mod:`.protocol`."""
