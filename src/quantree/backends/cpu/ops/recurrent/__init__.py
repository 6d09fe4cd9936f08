"""The recurrent ops' runners: a whole layer stack (``rnn``), a cell (``rnn_cell``), a packed
sequence (``rnn_packed``)."""
