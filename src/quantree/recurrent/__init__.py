"""Recurrent layers (LSTM, GRU, RNN and their cells) on top of the core.

Whole mode annotates ``aten.lstm``/``gru``/``rnn_*`` at their boundary; cells mode carries a
decomposition hook in its annotation that replaces the call by loops over a cell graph.
"""
