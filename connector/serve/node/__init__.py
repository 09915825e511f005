"""``kvbridge-node``: kvbridge's reference engine behind an OpenAI-style HTTP API (``server``), its
engine thread (``loop``), its Prometheus metrics (``metrics``) and the store role's app
(``store_app``)."""
