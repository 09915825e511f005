"""kvbridge.connector.store: the remote store tier for cold cached blocks.

``StoreNode`` (``node``) holds offloaded blocks (``cache``), takes writes on a small TCP server
(``server``, frames in ``wire``) and serves them back through the block index and the transport
like any holder; ``offload`` is a node's policy and client for writing its cold blocks there.
DESIGN.md, "One disaggregated request, end to end" (the store tier).
"""
