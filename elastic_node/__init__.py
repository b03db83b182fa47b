"""An elastic node: a node whose role (prefill, decode, colocated) changes at run time, weights, KV
pool and prefix cache kept (`kvbridge prefill|decode|serve --elastic`, Admin.SetRole)."""
