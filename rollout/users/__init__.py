"""Users and judges: interactions that take the user's turn (``interactions.py``: an answer checker;
``simulated_user.py``: a model playing the user), the LLM judge (``judge.py``) and the chat-model
client both use (``chat_model.py``)."""
