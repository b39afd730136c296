"""The model side: what vela-ray does to a transformers MoE model, with no Ray in sight.

`modeling` finds the MoE blocks and swaps their `experts` for `broker.ExpertBroker`s;
`experts.ExpertShard` is what a worker hosts; `transport` moves a layer's rows between
the two and `traffic` counts them; `loading` reads backbones and single experts from a
checkpoint; `adapters` maps vela-ray's LoRA to and from a standard peft adapter;
`families` lists the transformers MoE families it is tested on.
"""
