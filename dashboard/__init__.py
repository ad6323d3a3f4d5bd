"""The Streamlit operations dashboard; reads the store, never writes it."""
