use super::EtagForm;

#[test]
fn a_bare_form_drops_the_quotes_of_every_strong_tag_and_keeps_the_rest() {
    assert_eq!(EtagForm::Bare.render("\"abc\""), "abc");
    assert_eq!(EtagForm::Bare.render("\"a\", \"b-2\""), "a, b-2");
    assert_eq!(EtagForm::Bare.render("*"), "*");
    assert_eq!(EtagForm::Bare.render("W/\"a\""), "W/\"a\"");
    assert_eq!(EtagForm::Bare.render("abc"), "abc");
    // An empty pair of quotes is no ETag to unquote.
    assert_eq!(EtagForm::Bare.render("\"\""), "\"\"");
}

#[test]
fn the_quoted_form_is_the_value_as_the_upstream_answered_it() {
    assert_eq!(EtagForm::Quoted.render("\"a\", W/\"b\""), "\"a\", W/\"b\"");
}
