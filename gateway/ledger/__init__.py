"""The replica ledger: every gateway's in-flight requests per replica, shared through Redis, so
each gateway's admission view counts the others' work (docs/deployment.md, "Several gateways").

``state`` holds the pure parts (entries, the outbox, the remote ledger), ``redis_io`` the Redis
calls, ``live`` the tasks and the hooks into admission; ``config`` is the ``ledger:`` section.
"""
