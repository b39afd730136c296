"""What a run shows: metrics for the Ray dashboard (`metrics`), the HTML report and terminal
summary (`report`), and the locality study's figures (`plots`)."""
