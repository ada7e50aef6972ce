"""The models' torch side: the EAGLE-3 draft head in SGLang's checkpoint format
(``eagle3``), and a transformers MoE target driven over a batched KV cache with routing
capture (``target``, ``kvcache``). Loading a target is transformers' ``from_pretrained``,
called by the lab and the plugin: the library never imports transformers."""
