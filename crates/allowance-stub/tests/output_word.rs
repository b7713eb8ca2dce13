//! The output word is one o200k token per repetition, for every answer size
//! a test is likely to ask for: that is what makes `completion_tokens == N`
//! and one token per stream delta true.

mod common;

use allowance_stub::{OUTPUT_WORD, output_text};
use common::t;

#[test]
fn each_repetition_is_one_token() {
    for n in 1..=2000_u64 {
        let text = OUTPUT_WORD.repeat(n as usize);
        assert_eq!(t(&text), n, "{n} repetitions of {OUTPUT_WORD:?}");
    }
}

#[test]
fn output_text_is_the_word_repeated() {
    assert_eq!(output_text(0), "");
    assert_eq!(
        output_text(3),
        format!("{OUTPUT_WORD}{OUTPUT_WORD}{OUTPUT_WORD}")
    );
}
