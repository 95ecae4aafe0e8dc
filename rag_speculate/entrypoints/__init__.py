"""Where requests come in: the command line (`cli.py`), the OpenAI-compatible server (`openai/`) and,
shared by them and the LangChain and LlamaIndex adapters, the one prompt builder (`prompt.py`), tool
calls read back from answers (`tool_calls.py`) and the engines they share (`engines.py`)."""
