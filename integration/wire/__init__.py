"""What crosses the wire between the coordinator and the workers (no torch at import).

- :mod:`.protocol`: every store key, in one place, and the workers' messages.
- :mod:`.agent_messages`: the messages between the coordinator and the machines' agents.
- :mod:`.stores`: the job's key-value store (torch's TCPStore, or etcd).
- :mod:`.auth`: the job token that seals every value written to the store.
- :mod:`.net`: which address and interface a machine's processes use.
- :mod:`.heartbeat`: a worker's heartbeat thread.
- :mod:`.gloo_waits`: a generation's waits on gloo, ended by the generation's abort.
"""
