"""Generation servers: start, watch and stop transformers serve, vLLM, SGLang or an external
URL (servers), the managed processes behind them (supervisor), and the client the generate step
talks to them with (client)."""
