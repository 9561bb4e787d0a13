"""The VisualBERT paper's analyses for every architecture (SPEC §5).

grounding  entity grounding per attention head (§3.1, Figure 3): inputs, accumulator, result
syntactic  syntactic grounding (§3.1, Table 2, Figure 4)
text_syntax  the same arcs among the words (Clark et al., 2019): syntactic heads in the text
boxes      IoU and union boxes
figures    Figure 3 as a PNG (matplotlib, Agg)
report     best-head tables (Markdown, HTML) and a Markdown summary

Submodules are imported explicitly (figures pulls in matplotlib; nothing heavy runs at import).
"""
