# man pages of the tokenizer of libmlens: an overview and one page per
# function of mlens_tokenizer.h.
dist_man_MANS += man/mlens_tokenizer.3 man/mlens_tokenizer_open.3 man/mlens_tokenizer_free.3 \
	man/mlens_tokenizer_encode.3 man/mlens_tokenizer_decode.3 man/mlens_tokenizer_vocab_size.3 \
	man/mlens_tokenizer_token_id.3 man/mlens_tokenizer_id_token.3 man/mlens_tokenizer_is_special.3 \
	man/mlens_tokenizer_bos.3 man/mlens_tokenizer_eos.3 man/mlens_detok_new.3 \
	man/mlens_detok_push.3 man/mlens_detok_flush.3 man/mlens_detok_free.3
