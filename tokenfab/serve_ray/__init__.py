"""Replicas on Ray Serve: `tokenfab serve --replicas N` (docs/scale_out.md).

- routing.py   the routing policy, pure: prefix keys, bounded-load prefix affinity, least loaded, the
               decision counters. No Ray import, so it is unit-tested without a cluster.
- router.py    that policy as a Ray Serve RequestRouter (the extension point), run in the ingress's handles.
- replica.py   the deployment: one AsyncEngine per replica, streaming RequestOutputs.
- pool.py      the ingress's engine: an AsyncEngine look-alike that sends requests to the pools, retries
               what never started, and aggregates the replicas' stats for /metrics and /health.
- deploy.py    starting Ray and the pools (from flags or a Ray Serve config file); `serve_replicas`.

The ingress app on the pools and its per-replica /metrics are the server's (server/ingress.py).

Nothing here is imported unless `--replicas` or `--config` is given: Ray is the optional extra `tokenfab[ray]`.
"""
