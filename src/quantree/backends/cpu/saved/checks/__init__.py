"""What a file read from disk must satisfy before it runs: the closed op vocabulary, bounded
text (JSON depth, the shape grammar), streamed member checks, the load budget and what is
charged to it (recipes, tables), and one run on fake tensors like the saved example."""
