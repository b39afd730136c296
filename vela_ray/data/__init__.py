"""Data in, routing statistics out.

`datasets` turns text or instruction files into tokenized rows and batches;
`locality` measures which experts those tokens pick (the access profile P[L, E]
the placement is solved for) and how routing drifts while fine-tuning.
"""
