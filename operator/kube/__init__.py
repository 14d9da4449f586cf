"""The operator's Kubernetes API: the client per kind of child (client.py), what its errors mean
(errors.py), the optional APIs of other projects' CRDs (custom_api.py, inferencepool.py,
leaderworkerset.py), leader election and the fence on every write (leader.py), the worker pods'
informer and owner chains (pods.py), access reviews (access.py)."""
